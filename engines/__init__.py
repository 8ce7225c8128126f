"""The sampling side: the `Engine` contract and the built-in `TorchEngine` with its kept prefix
rows (torch_engine.py), vLLM behind the same contract (vllm_engine.py), what a lower-precision
engine computes (precision.py), and async rollouts on top (pipeline.py). Split inference's
engine, which lives on other ranks, is run/remote.py."""
