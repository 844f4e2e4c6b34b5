"""experiments/kernel_bench.py's correctness checks on its runlocal config (the kernels in
interpret mode): the launcher imports what the kernels export today, the window reaches
the kernel as position rules, and its guards bite (K and V swapped is far off)."""
from __future__ import annotations

import pytest

from configs import kernel_bench as kernel_bench_config
from experiments import kernel_bench


@pytest.mark.slow  # ~40 s of interpret-mode kernels
def test_runlocal_checks_agree_with_the_references():
  cfg = kernel_bench_config.get_config("runlocal")
  checks = kernel_bench.run_checks(cfg, cfg.head_dim ** -0.5)
  for name in ("rpa_mixed_max_err", "rpa_window40_cap20_max_err", "rpa_int8_max_err"):
    assert checks[name] < 0.05, (name, checks[name])  # bf16 pages' rounding
  assert checks["rpa_kv_swapped_max_err"] > 1.0
  assert checks["rpa_batch_invariance_max_diff"] == 0.0
  assert checks["rs_tokens_equal_frac"] == 1.0 and checks["rs_num_accepted_equal_frac"] == 1.0
