"""The runtime: requests, slots and the step loop (engine), per-slot state, plain decode,
the speculative step (draft -> verify -> accept -> commit), commit strategies, sampling,
statistics and NVTX ranges. Imports models, never serving."""
