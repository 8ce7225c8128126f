"""What the model, the loss and the engines are built from: the packed forward's attention
(attention.py), LoRA adapters on the linear layers (lora.py), the loss's sequence and KL masks
and the per-token arithmetic it shares (masks.py), and torchrun's ranks with FSDP2 and the
step's collectives (parallel.py). Each imports nothing of floe's but config.py and parallel.py."""
