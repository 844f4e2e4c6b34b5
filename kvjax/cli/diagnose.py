"""`python -m kvjax diagnose`: which kind of slow a live server or a bench run is, and what to do.

(Claim C18's diagnosis.)

  python -m kvjax diagnose --url http://127.0.0.1:8000 --window 30 --ttft-ms 200 --tpot-ms 20
  python -m kvjax diagnose --bench-json results/bench_http_random.json --ttft-ms 200 --tpot-ms 20

--url scrapes GET /metrics at the start of a --window of seconds, every
--interval, and at its end (counters and histograms: the window's deltas;
gauges: the mean of the samples).  --bench-json reads what
`python -m kvjax bench --url` wrote.  Configured concurrency is the server's
kvjax:max_num_seqs gauge if it has one, else --max-num-seqs.  Prints the
seed's numbers, the kind of slow (idle, healthy, prefill, decode, concurrency) and
the seed's remedies in order (kvjax/server/bench/diagnose.py says how it decides).
"""
from __future__ import annotations

import argparse
import json

__all__ = ["add_parser", "run"]


def add_parser(subparsers) -> argparse.ArgumentParser:
  """Registers the `diagnose` sub-command on an argparse `subparsers` object."""
  p = subparsers.add_parser("diagnose", help="which kind of slow a server is (prefill, decode, "
                            "concurrency) and what to do, from its metrics",
                            description=__doc__.splitlines()[0])
  source = p.add_mutually_exclusive_group(required=True)
  source.add_argument("--url", default=None,
                      help="server URL, its root or its /v1 base (this or --bench-json)")
  source.add_argument("--bench-json", default=None,
                      help="a `kvjax bench --url` result file (this or --url)")
  p.add_argument("--window", type=float, default=10.0,
                 help="seconds of /metrics to read; send traffic meanwhile (default: "
                      "%(default)s)")
  p.add_argument("--interval", type=float, default=1.0,
                 help="seconds between gauge samples (default: %(default)s)")
  p.add_argument("--ttft-ms", type=float, default=500.0,
                 help="time to first token (ms) above which it counts as slow (default: "
                      "%(default)s)")
  p.add_argument("--tpot-ms", type=float, default=50.0,
                 help="time per output token (ms) above which it counts as slow (default: "
                      "%(default)s)")
  p.add_argument("--kv-full", type=float, default=0.9,
                 help="KV utilization (0..1) from which the pool counts as full (default: "
                      "%(default)s)")
  p.add_argument("--max-num-seqs", type=float, default=None,
                 help="configured concurrency (default: the server's kvjax:max_num_seqs "
                      "gauge)")
  p.add_argument("--json", action="store_true",
                 help="print one JSON object (default: a table)")
  p.set_defaults(func=run)
  return p


def run(args: argparse.Namespace) -> int:
  import dataclasses

  from kvjax.server.bench import diagnose

  targets = diagnose.Targets(args.ttft_ms / 1e3, args.tpot_ms / 1e3, args.kv_full)
  if args.bench_json is not None:
    with open(args.bench_json) as f:
      signals = diagnose.signals_from_bench(json.load(f), args.max_num_seqs)
  else:
    first, last, samples = diagnose.sample_window(args.url, args.window, args.interval)
    signals = diagnose.signals_from_window(first, last, samples, args.max_num_seqs)
  result = diagnose.diagnose(signals, targets)
  if args.json:
    print(json.dumps({"signals": dataclasses.asdict(signals),
                      "diagnosis": dataclasses.asdict(result)}))
  else:
    print(diagnose.format_report(signals, result))
  return 0
