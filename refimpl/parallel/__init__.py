"""Parallelism strategies built from scratch: data parallelism (chapter 03), and later ZeRO/FSDP, tensor,
sequence and pipeline parallelism. Import from the submodules, e.g.
``from refimpl.parallel.data_parallel import DataParallelBucket``.
"""
