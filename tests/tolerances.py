"""Every float tolerance the tests use, in one table (integer outputs are compared exactly)."""
import torch

# fp32 logits of our transformer vs HF transformers on the same weights (issue 2's bar).
LOGITS_FP32_ATOL = 1e-3

# Triton kernel vs torch reference, float outputs (attention outputs, scores), by dtype: (atol, rtol).
KERNEL_TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}

# Triton quant_matmul vs its torch reference, by dtype: (rtol, atol as a fraction of the output's
# largest value). The kernel rounds each dequantized weight to the compute dtype before its dot
# (the reference keeps fp32), so an output that cancels to near zero carries the rounding of its
# terms, not its own: the absolute part scales with the output's range.
QUANT_MATMUL_TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (8e-3, 8e-3),
}
