"""The MLX interpreter and its storage: effects carried out on real mlx-lm caches and files.

``interpreter`` performs the core's effects; ``caches`` is one codec per mlx-lm cache class;
``disk_store`` writes and reads saved state (safetensors files, atomic, hashed, verified: their
framing in ``framing``, raw reads and writes through ``file_io``), under
one byte budget for a root (``disk_budget``); ``device_memory`` moves restored arrays onto a CUDA
device, ``host_memory`` keeps freed host memory for reuse; ``content_hash`` and
``weights_identity`` give content and model identities. Nothing here imports the service facade or
the simulator (``tests/test_contract.py``).
"""
