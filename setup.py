from setuptools import find_packages, setup

setup(
    name="pat_rollout",
    version="0.1.0",
    description="PAT: predictor-guided, lightweight online tensor-parallel reconfiguration for RL rollouts (VeRL backend)",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10,<3.13",
    packages=find_packages(include=["pat_rollout", "pat_rollout.*"]),
    package_data={"pat_rollout": ["profile/data/*.json", "verl/config/*.yaml"]},
    install_requires=[
        "torch>=2.4",
        "ray[default]>=2.40",
        "hydra-core>=1.3",
        "omegaconf>=2.3",
        "transformers>=5.5.3,<5.11",  # the range verl 0.9.1 accepts
        "safetensors",
        "numpy",
        "wandb",
    ],
    extras_require={
        "test": ["pytest>=8", "pytest-timeout", "ruff"],
        # TransferQueue: verl 0.9.1's v1 trainer (trainer.use_v1=true, its default); verl lists it only in its
        # verl-core extra (>=0.1.10). Pinned to the version the end-to-end tests ran with.
        "verl": ["verl==0.9.1", "TransferQueue==0.1.11", "fastapi", "uvicorn", "cachetools", "msgspec", "pyzmq"],
        # No "sglang" extra: sglang and verl 0.9.1 pin disjoint transformers versions, so pip cannot resolve both;
        # see recipes/deepscaler/README.md (GPU) and the Makefile's install-sglang / install-verl-sglang (CPU tests).
    },
    entry_points={
        # verl imports every `verl.plugins` entry point on `import verl`: this registers rollout.name=pat.
        "verl.plugins": ["pat = pat_rollout.verl.register"],
        "console_scripts": ["pat-rollout-demo = pat_rollout.demo:main"],
    },
)
