"""What both ends of a weight push speak: the trainer (fsdpfn.weights) and the rollout server
(fsdpfn.rollout) import this package, never each other.

protocol  dtype names, the flat-bucket layout, checksums, the disk manifest, the process group
fused     the checksums' one-pass CUDA kernel (Triton; the portable path gives the same numbers)
frames    frames of the update channel (length-prefixed JSON over TCP)
http      the JSON-over-HTTP client, a thread runner with a deadline, the rule of a server URL
ipc       CUDA IPC handles as plain JSON
model_fingerprint  the config fields that change the forward, hashed alike on both ends
"""
