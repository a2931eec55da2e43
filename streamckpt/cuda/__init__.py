"""All CUDA-specific code, thin: the ordering rules of the GPU path (``device``) over one small
runtime interface (``runtime.CudaApi``, a test's stand-in or ``TorchCuda``).

The only place that touches CUDA streams and events; it imports ``core`` and ``plan.data`` only.
"""
