"""Triton kernels of the decoder layer, shared by the ``nvidia`` and ``amd`` plugins.

Kernels run compiled on GPU tensors, or on CPU tensors under Triton's interpreter when
``TRITON_INTERPRET=1`` was set before triton was imported (how the CPU tests run them).
"""
