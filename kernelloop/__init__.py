"""kernelloop: language-model-written kernels, judged by a harness that cannot be fooled."""

__version__ = "0.1.0"
