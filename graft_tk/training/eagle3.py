"""Train an EAGLE-3 head for a target: the training-time test of EAGLE-3, on this machine.

One training step, for a batch of token windows x_0..x_{T-1}:

1. The target runs once (no grad) and gives, at every position t, its fused features f_t (the
   head's ``target_layers``) and its next-token logits, cut to the draft vocabulary.
2. The head is unrolled ``ttt_depth`` times, as it drafts at test time (see drafting.py):
   step 0, entry t: ``(fc(f_t), x_{t+1})`` at position t; step j > 0, entry t: ``(h^{j-1}_t,
   x_{t+1+j})`` at position t + j, where h^{j-1}_t is the head's own output one step earlier. Entry
   t of step j attends to the step-0 keys of entries 0..t (the committed prefix, built from target
   features) and to its own keys of steps 1..j (its ancestors in the draft tree): one attention
   over the concatenated keys with mask ``[causal | I | ... | I]``.
3. Loss of step j: cross-entropy of the head's distribution against the target's (softmax over
   the draft vocabulary) at position t + 1 + j, where the target's top token is in the draft
   vocabulary, weighted 0.8^j; accuracy = how often the head's top token is the target's.

Initialisation: the reduced lm_head and the final norm start as the target's own (rows of the
draft vocabulary); everything else is random (seeded); or, with ``init``, a trained head's weights
and vocabulary (fine-tuning). The token embedding is the target's, shared and frozen, as EAGLE-3
trains it.

A run lives in one folder: the head in the published layout (``load_eagle3`` reads it) plus
``trainer_state.pt`` (settings, corpus, optimizer, step, log) and ``training.png``, replaced
together atomically at every save; run it again with the same folder to resume.
"""
from __future__ import annotations

import dataclasses
import io
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm.auto import tqdm

from ..errors import CorruptFileError, InputError
from ..models import Model
from ..models.eagle3 import Eagle3Config, Eagle3Head
from ..models.eagle3_checkpoint import load_eagle3, save_eagle3
from ..models.transformer import rope_tables
from .corpus import Corpus, distilled_documents, draft_vocab, file_documents, stdlib_documents

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.pt"
STATE_VERSION = 1
HELDOUT_WINDOWS = 16


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 600
    batch_size: int = 4
    seq_len: int = 256
    lr: float = 1e-3
    warmup: int = 30                 # linear warm-up steps, then cosine to lr / 10
    ttt_depth: int = 4               # unrolled drafting steps (EAGLE-3 uses 7)
    step_decay: float = 0.8          # loss weight of step j: decay ** j
    draft_vocab: int = 8192
    stdlib_tokens: int = 400_000     # standard-library source tokens
    distill_prompts: int = 48        # target-generated answers to standard-library function prompts
    distill_tokens: int = 160        # tokens generated per answer
    distill_weight: int = 8          # each answer appears this many times per epoch (they are few and on-task)
    data: tuple[str, ...] = ()       # extra training files (see corpus.file_documents)
    init: str | None = None          # start from this head's weights and vocabulary (fine-tuning)
    seed: int = 0
    save_every: int = 100
    mixed_precision: bool = True     # bf16 autocast for the head's matmuls (fp32 weights and optimizer)

    def __post_init__(self):
        for name in ("steps", "batch_size", "ttt_depth", "draft_vocab", "save_every", "distill_tokens",
                     "distill_weight"):
            if getattr(self, name) < 1:
                raise InputError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.seq_len < 8:
            raise InputError(f"--seq-len must be >= 8, got {self.seq_len}")
        if not self.lr > 0:
            raise InputError(f"--lr must be > 0, got {self.lr}")
        if self.stdlib_tokens < 0 or self.distill_prompts < 0:
            raise InputError("--stdlib-tokens and --distill-prompts must be >= 0")

    def resumable_with(self, other: TrainConfig) -> list[str]:
        """Settings that differ from ``other`` other than ``steps`` / ``save_every`` (which a resume may change)."""
        return [f.name for f in dataclasses.fields(self) if f.name not in ("steps", "save_every")
                and getattr(self, f.name) != getattr(other, f.name)]


# --- the training-time test ------------------------------------------------------------------

@dataclass
class TargetBatch:
    """What the target says about a batch of windows (no grad)."""
    tokens: Tensor        # int64 [B, T]
    valid: Tensor         # bool [B, T]
    features: Tensor      # [B, T, n * target_dim]
    logits: Tensor        # float32 [B, T, draft_vocab]: target logits at the draft vocabulary
    in_vocab: Tensor      # bool [B, T]: the target's top token is in the draft vocabulary


@torch.no_grad()
def target_batch(target: Model, head: Eagle3Head, tokens: Tensor, valid: Tensor) -> TargetBatch:
    B, T = tokens.shape
    net = target.net
    net.setup_cache(T, batch_size=B)
    tokens = tokens.to(target.device)
    logits, features = net(tokens, torch.arange(T, device=tokens.device), 0, hidden_layers=head.target_layers)
    in_vocab = head.t2d[logits.argmax(-1)]
    return TargetBatch(tokens, valid.to(target.device), features, logits[..., head.draft_ids], in_vocab)


def unroll(head: Eagle3Head, features: Tensor, tokens: Tensor, depth: int) -> list[Tensor]:
    """The head drafting ``depth`` steps from every position at once (module docstring, step 2).

    features [B, T, n * target_dim], tokens [B, T] -> per step j, logits [B, T - 1, draft_vocab]:
    entry t of step j predicts x_{t+2+j}. Token indices past the window are clamped (their
    entries are masked out of the loss).
    """
    layer, attn = head.layer, head.layer.attention
    w = head.fc.weight
    B, T = tokens.shape
    n = T - 1
    t = torch.arange(n, device=tokens.device)
    causal, eye = t[:, None] >= t[None, :], t[:, None] == t[None, :]
    h = head.fc(features[:, :n].to(w.dtype))
    keys, values, masks, out_logits = [], [], [causal], []
    for j in range(depth):
        emb = F.embedding(tokens[:, (t + 1 + j).clamp(max=T - 1)], head.embedding_weight).to(w.dtype)
        x, residual = layer.attention_input(emb, h)
        q, k, v = attn.project(x, *rope_tables((t + j)[None].expand(B, -1), head.inv_freq, w.dtype))
        keys.append(k)
        values.append(v)
        if j:
            masks.append(eye)
        out = F.scaled_dot_product_attention(q, torch.cat(keys, 2), torch.cat(values, 2),
                                             attn_mask=torch.cat(masks, 1), enable_gqa=True)
        h = layer.mlp(residual + attn.wo(out.transpose(1, 2).reshape(B, n, -1)))
        out_logits.append(head.lm_head(head.norm(h)).float())
    return out_logits


def ttt_loss(head: Eagle3Head, batch: TargetBatch, depth: int, decay: float) -> tuple[Tensor, list[float]]:
    """The unrolled loss (module docstring, step 3) -> (weighted loss, top-1 accuracy per step)."""
    T = batch.tokens.shape[1]
    t = torch.arange(T - 1, device=batch.tokens.device)
    loss, accuracy = batch.logits.new_zeros(()), []
    for j, logits in enumerate(unroll(head, batch.features, batch.tokens, depth)):
        nxt = (t + 1 + j).clamp(max=T - 1)              # where the target's answer for step j is
        use = batch.valid[:, nxt] & batch.in_vocab[:, nxt] & (t + 1 + j < T)
        target = batch.logits[:, nxt]
        ce = -(target.softmax(-1) * logits.log_softmax(-1)).sum(-1)
        count = use.sum().clamp(min=1)
        loss = loss + decay ** j * (ce * use).sum() / count
        accuracy.append(float(((logits.argmax(-1) == target.argmax(-1)) & use).sum() / count))
    return loss, accuracy


# --- setting up a run ------------------------------------------------------------------------

def build_corpus(target: Model, cfg: TrainConfig, progress: bool) -> Corpus:
    docs = stdlib_documents(target, cfg.stdlib_tokens, cfg.seed) if cfg.stdlib_tokens else []
    if cfg.distill_prompts:
        docs += cfg.distill_weight * distilled_documents(target, cfg.distill_prompts, cfg.distill_tokens, cfg.seed,
                                                         progress)
    docs += file_documents([Path(p) for p in cfg.data], target)
    return Corpus.from_documents(docs, cfg.seq_len)


def init_head(target: Model, d2t: Tensor, seed: int) -> Eagle3Head:
    """A fresh head for ``target`` (fp32, trainable), lm_head and norm from the target."""
    torch.manual_seed(seed)
    cfg = Eagle3Config.for_target(target.config, draft_vocab_size=d2t.shape[0])
    head = Eagle3Head(cfg, target.net.tok_embeddings.weight)   # shared and frozen, as load_eagle3 shares it
    head.set_vocab_map(d2t)
    with torch.no_grad():
        head.lm_head.weight.copy_(target.net.lm_head_weight[head.draft_ids].float())
        head.norm.weight.copy_(target.net.norm.weight.float())
    return head.to(target.device)


def _lr(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


@torch.no_grad()
def evaluate(target: Model, head: Eagle3Head, heldout: Corpus, cfg: TrainConfig) -> dict:
    """Held-out loss and top-1 accuracy per unrolled step (accuracy of step j ~ a depth-(j+1) draft
    token matching the target's greedy choice, given its ancestors matched)."""
    losses, accs = [], []
    for idx in torch.arange(heldout.tokens.shape[0]).split(cfg.batch_size):
        loss, acc = ttt_loss(head, target_batch(target, head, *heldout.take(idx)), cfg.ttt_depth, cfg.step_decay)
        losses.append(float(loss))
        accs.append(acc)
    return {"loss": sum(losses) / len(losses), "accuracy": [sum(a) / len(a) for a in zip(*accs)]}


def _save(out: Path, head: Eagle3Head, state: dict) -> None:
    buf = io.BytesIO()
    torch.save(state, buf)
    png = _plot(state["log"], state["evals"])
    save_eagle3(head, out, extra_files={STATE_FILE: buf.getvalue(), "training.png": png,
                                        "training_log.json": json.dumps(
                                            {"config": state["config"], "log": state["log"],
                                             "evals": state["evals"]}, indent=1).encode()})


def _load_state(out: Path) -> dict:
    path = out / STATE_FILE
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for a truncated or foreign file
        raise CorruptFileError(f"{path} cannot be read ({e}); delete the folder or pass --restart") from e
    if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
        raise CorruptFileError(f"{path} is not a graft-train-eagle3 state of version {STATE_VERSION}; "
                               "pass --restart to train from scratch")
    return state


def _plot(log_rows: list[dict], evals: list[dict]) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4), layout="constrained")
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    if log_rows:
        left.plot([r["step"] for r in log_rows], [r["loss"] for r in log_rows], lw=0.8, label="train")
    if evals:
        left.plot([e["step"] for e in evals], [e["loss"] for e in evals], "o-", label="held-out")
        for j in range(len(evals[0]["accuracy"])):
            right.plot([e["step"] for e in evals], [e["accuracy"][j] for e in evals], "o-", label=f"step {j}")
    left.set(xlabel="step", ylabel="loss (weighted over unrolled steps)", title="EAGLE-3 head training")
    right.set(xlabel="step", ylabel="held-out top-1 agreement with target", ylim=(0, 1),
              title="accuracy per unrolled (draft) step")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    return buf.getvalue()


# --- the loop --------------------------------------------------------------------------------

def train(target: Model, out: str | Path, cfg: TrainConfig, restart: bool = False, progress: bool = True) -> dict:
    """Train (or resume training) a head for ``target`` into ``out``; returns the last evaluation."""
    out = Path(out).expanduser()
    state = None
    if (out / STATE_FILE).exists() and not restart:
        state = _load_state(out)
        saved = TrainConfig(**{**state["config"], "data": tuple(state["config"]["data"])})
        differ = cfg.resumable_with(saved)
        if differ:
            raise InputError(f"{out} holds a run with other settings ({', '.join(differ)}); resume with the same "
                             "settings, pass another --out, or --restart to overwrite it")
        if state["target"] != target.name:
            raise InputError(f"{out} holds a head for {state['target']}, not {target.name}")
    elif out.exists() and any(out.iterdir()) and not restart:
        raise InputError(f"{out} exists and is not a graft-train-eagle3 run; pass an empty or new folder "
                         "(or --restart to overwrite it)")

    if state is None:
        corpus = build_corpus(target, cfg, progress)
        train_set, heldout = corpus.split(min(HELDOUT_WINDOWS, max(1, corpus.tokens.shape[0] // 10)), cfg.seed)
        counts = train_set.token_counts(target.config.vocab_size)
        if cfg.init:
            head = load_eagle3(cfg.init, target, dtype=torch.float32).requires_grad_(True).train()
            if head.config.draft_vocab_size != cfg.draft_vocab:
                raise InputError(f"--init {cfg.init} has a draft vocabulary of {head.config.draft_vocab_size}; "
                                 f"pass --draft-vocab {head.config.draft_vocab_size}")
        else:
            head = init_head(target, draft_vocab(counts, cfg.draft_vocab), cfg.seed)
        optimizer = torch.optim.AdamW(_trainable(head), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
        state = {"version": STATE_VERSION, "target": target.name, "step": 0, "log": [], "evals": [],
                 "corpus": {"train": dataclasses.asdict(train_set), "heldout": dataclasses.asdict(heldout)}}
        covered = float(counts[head.draft_ids.cpu()].sum() / counts.sum())
        log.info("corpus: %d training tokens in %d windows, %d held-out windows; draft vocabulary %d covers "
                 "%.1f%% of training tokens", train_set.n_tokens, train_set.tokens.shape[0],
                 heldout.tokens.shape[0], cfg.draft_vocab, 100 * covered)
    else:
        train_set, heldout = Corpus(**state["corpus"]["train"]), Corpus(**state["corpus"]["heldout"])
        head = load_eagle3(out, target, dtype=torch.float32).requires_grad_(True).train()
        optimizer = torch.optim.AdamW(_trainable(head), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
        optimizer.load_state_dict(state["optimizer"])
        log.info("resuming %s at step %d of %d", out, state["step"], cfg.steps)
    state["config"] = {**dataclasses.asdict(cfg), "data": list(cfg.data)}

    def save(step: int) -> None:
        state["step"], state["optimizer"] = step, optimizer.state_dict()
        _save(out, head, state)

    start = state["step"]
    if start == 0:
        state["evals"] = [{"step": 0, **evaluate(target, head, heldout, cfg)}]
        save(0)
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc="train eagle3", unit="step",
               disable=not progress)
    done, updating = start, False     # steps whose update is complete; inside optimizer.step?
    try:
        for step in bar:
            t0 = time.perf_counter()
            lr = _lr(cfg, step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            tokens, valid = train_set.batch(step, cfg.batch_size, cfg.seed)
            batch = target_batch(target, head, tokens, valid)
            with torch.autocast(batch.tokens.device.type, dtype=torch.bfloat16, enabled=cfg.mixed_precision):
                loss, acc = ttt_loss(head, batch, cfg.ttt_depth, cfg.step_decay)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(_trainable(head), 1.0)
            updating = True
            optimizer.step()
            done, updating = step + 1, False
            loss, tokens_per_s = loss.item(), int(valid.sum()) / (time.perf_counter() - t0)
            state["log"].append({"step": done, "loss": loss, "accuracy": acc, "lr": lr, "tokens_per_s": tokens_per_s})
            bar.set_postfix(loss=f"{loss:.3f}", acc0=f"{acc[0]:.2f}", tok_s=f"{tokens_per_s:.0f}")
            if done % cfg.save_every == 0 or done == cfg.steps:
                state["evals"].append({"step": done, **evaluate(target, head, heldout, cfg)})
                save(done)
    except KeyboardInterrupt:
        if updating:   # the weights may be half-updated: keep the last checkpoint
            log.warning("interrupted mid-update: %s keeps its last checkpoint (run the same command to resume)", out)
        else:
            log.warning("interrupted: saving step %d to %s (run the same command to resume)", done, out)
            state["log"] = state["log"][:done]
            save(done)
        raise
    return state["evals"][-1]


def _trainable(head: Eagle3Head) -> list[Tensor]:
    return [p for name, p in head.named_parameters() if not name.startswith("tok_embeddings")]
