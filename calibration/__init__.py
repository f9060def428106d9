"""graft-calibrate: Optuna search of tau / N / K / D / retrieval per (target, drafter, device, dtype),
and the profiles that ``graft_tk.decode`` loads by default.

    profiles.py    profile identity, atomic JSON files, stale / corrupt detection (no optuna import)
    warm_start.py  (drafter score, accepted?) -> isotonic fit -> the tau to try first
    search.py      search space, measured objective with exactness check, study handling, held-out check
    report.py      the trials picture and the text summary
"""
