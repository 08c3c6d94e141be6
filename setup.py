"""Install script for mist-compiler (package ``mist_compiler``, console script ``mistc``)."""
from setuptools import find_packages, setup

setup(
    name="mist-compiler",
    version="0.1.0",
    description="Automatic distributed-training compiler for large language models",
    python_requires=">=3.10",
    packages=find_packages(include=["mist_compiler", "mist_compiler.*"]),
    package_data={"mist_compiler.cost": ["profiles/*.yaml"], "mist_compiler.training": ["data/*.txt"]},
    install_requires=[
        # torch is not pinned here: 2.11 to 2.13 are supported (CI pins 2.13.0).
        "torch>=2.11",
        "sympy>=1.13",
        "networkx>=3.0",
        "numpy>=1.26",
        "pyyaml>=6.0",
        "triton>=3.1",
        "mip>=1.15",  # the activation MILP (tuner/activation_milp.py) with its bundled CBC
    ],
    extras_require={
        # pytest-xdist: the suite runs in two workers (pytest.ini), most tests wait on subprocesses
        "test": ["pytest>=8", "pytest-xdist>=3.5", "transformers>=4.40", "safetensors>=0.4", "matplotlib>=3.7"],
        "hf": ["transformers>=4.40", "safetensors>=0.4"],  # hf: models, pretrained checkpoints, --export
        "gpu": ["flash-attn>=2.5", "matplotlib>=3.7"],
        "plot": ["matplotlib>=3.7"],
    },
    entry_points={
        "console_scripts": ["mistc = mist_compiler.cli:main"],
        "torch_dynamo_backends": ["mist = mist_compiler.torch_compile.backend:mist_backend"],
    },
)
