# python -m experiments.build_corpus --config=configs/build_corpus.py
r"""Builds the code corpus of the next default model (issue 18): stdlib + pinned wheels.

Fetches every pinned wheel by exact version into cache_dir (outside the repository;
skipped when a file with the pinned sha256 is already there), checks its sha256,
reads the `.py` files out of the zips, deduplicates, splits by package and writes
kvjax/assets/code_corpus_manifest.json plus the pack <cache_dir>/code_corpus.zip
(the kept files; what training reads).  About 2 minutes on 2 CPU cores.

Smoke run (two small packages, no stdlib, manifest to /tmp; seconds):
  python -m experiments.build_corpus --config=configs/build_corpus.py:runlocal

Packages: permissively licensed (Apache-2.0, BSD, MIT; the manifest records each
wheel's license field), mostly pure Python.  Order matters only as a dedup
tie-break: of two copies the one earlier here stays, so the vendoring pip is last.
"""
import ml_collections

# (name, exact version, sha256 of the wheel pip downloads with the pip_* options below)
PINNED = (
    ("numpy", "2.4.6", "89cd468399cfd2504718f0ba50e410dca55a170b61a02ad92bb18c8a65186e93"),
    ("jax", "0.10.2", "724d73c4678d8b06f6a6ab4db1b8a2fea8cd4f1e2c2564f99601634ec7b8d1c6"),
    ("flax", "0.12.8", "807931d369cbc716fc447801ab39cd6c3c2614d573387a2319a028675dd34fe5"),
    ("optax", "0.2.8", "e3ca2d36c99daab1800ae9dbc0545034382d6bc780b24d969e1b0df65fa31cb4"),
    ("chex", "0.1.92", "f34989d9bff7954edfab09fba7757e3d62404da34577bff0d253599ec5b4f93d"),
    ("absl_py", "2.5.1", "721200f2f0e9960f2ca9dc3a2a706b201f5f75d812c158f059cbbe29eeafbdb8"),
    ("ml_collections", "1.1.0",
     "23b6fa4772aac1ae745a96044b925a5746145a70734f087eaca6626e92c05cbc"),
    ("etils", "1.14.0", "b5df7341f54dbe1405a4450b2741207b4a8c279780402b45f87202b94dfc52b4"),
    ("orbax_checkpoint", "0.12.4",
     "f16d87e2c86d69480cdd2af21e53d2928fbeea0e432e35cb31600d547e035ecd"),
    ("einops", "0.8.2", "54058201ac7087911181bfec4af6091bb59380360f069276601256a76af08193"),
    ("transformers", "5.24.0",
     "ff5ebedf9359f94bb63772b6380eba6e7104d010cbbb2cb82c788817ea7486f6"),
    ("sympy", "1.14.0", "e091cc3e99d2141a0ba2847328f5479b05d94a6635cb96148ccb3f34671bd8f5"),
    ("networkx", "3.6.1", "d47fbf302e7d9cbbb9e2555a0d267983d2aa476bac30e90dfbe5669bd57f3762"),
    ("pydantic", "2.13.5", "346a034f080da3755d8e9cb5e00e8b07de1d39e4f6e2c87d8ab7cafa0b269a73"),
    ("attrs", "26.1.0", "c647aa4a12dfbad9333ca4e71fe62ddc36f4e63b2d260a37a8b83d2f043ac309"),
    ("click", "8.5.0", "255bc9599cf7748b4b1a446ccc735421bd08a2ae529a8b88597d3de5664ee360"),
    ("requests", "2.34.2", "2a0d60c172f83ac6ab31e4554906c0f3b3588d37b5cb939b1c061f4907e278e0"),
    ("rich", "15.0.0", "33bd4ef74232fb73fe9279a257718407f169c09b78a87ad3d296f548e27de0bb"),
    ("pygments", "2.21.0", "2363c69b61c4a97c838da3b130dcd6468f4848992b21a82f2a63ec34377137d9"),
    ("jinja2", "3.1.6", "85ece4451f492d0c13c5dd7c13a64681a86afae63a5f347908daf103ce6d2f67"),
    ("werkzeug", "3.1.9", "6392e50c78460ba618e5b21f08a71f59c99ce99cdc6cf6e3dd7e6ccca8754fab"),
    ("flask", "3.1.3", "f4bcbefc124291925f1a26446da31a5178f9483862233b23c0c96a20701f670c"),
    ("httpx", "0.28.1", "d909fcccc110f8c7faf814ca82a9a4d816bc5a6dbfea25d6591d6985b8ba59ad"),
    ("starlette", "1.7.0", "67f8e99895493dd2911a03f11314af6ceebeae4e704bb9f43dfc6a9db151c93e"),
    ("toolz", "1.2.0", "890f820b1cb8152785aaf9386d8707770110809035800985ca65cb24ce1120ef"),
    ("more_itertools", "11.1.0",
     "4b65538ae22f6fed0ce4874efd317463a7489796a0939fa66824dd542125a192"),
    ("boltons", "26.2.0", "41942cbce440211bbcf2487ccdc356964ad674f95a01068b8a0dd7a1d1fed036"),
    ("sortedcontainers", "2.4.0",
     "a163dcaede0f1c021485e957a39245190e74249897e2ae4b2aa38595db237ee0"),
    ("pip", "26.2.1", "71138adf1f4ca900cdb7d289c21b7494329f2332b6d85f0e1c42108c0384ed3e"),
)


def get_config(arg=None):
  config = ml_collections.ConfigDict()
  config.packages = PINNED
  # pip download options: the same wheel file (and sha256) on any machine.
  config.pip_platforms = ("manylinux_2_28_x86_64", "manylinux2014_x86_64")
  config.pip_python_version = "3.11"
  config.cache_dir = "~/.cache/kvjax/corpus"  # wheels and the pack; never in the repo
  config.pack_name = "code_corpus.zip"
  config.manifest = "kvjax/assets/code_corpus_manifest.json"

  config.include_stdlib = True  # the interpreter's stdlib as the training source python-stdlib
  # Split: networkx (graph algorithms, vendored by no other package) is the unseen set;
  # of the rest, sha256(name) < 0.1 holds out attrs, boltons and sortedcontainers.
  config.unseen = ("networkx",)
  config.heldout_fraction = 0.1
  config.near_threshold = 0.7  # Jaccard of 5-token shingle sets
  config.max_file_bytes = 500_000
  config.max_numeric_fraction = 0.4  # more number literals than this: a generated table
  # transformers' modular_*.py are the generator inputs of the modeling_*.py it also ships.
  config.exclude = ("transformers/models/*/modular_*.py",)

  if arg == "runlocal":
    config.packages = tuple(p for p in PINNED if p[0] in ("einops", "toolz"))
    config.include_stdlib = False
    config.unseen = ("toolz",)
    config.pack_name = "code_corpus_runlocal.zip"
    config.manifest = "/tmp/kvjax_build_corpus_runlocal/code_corpus_manifest.json"
  return config
