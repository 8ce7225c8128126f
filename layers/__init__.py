"""What the model, the head, the loss and the engines are built from: the packed forward's attention
(attention.py), the LM head's Triton kernels with their launchers and tiles (headkernels.py, behind
kernels.py's `triton_head`), LoRA adapters on the linear layers (lora.py), the loss's sequence and KL
masks, M2PO's bound and the per-token and (sum, count) metric arithmetic it shares (masks.py), the
loss's parts that need no loss table (terms.py), and torchrun's ranks with FSDP2 and the step's
collectives (parallel.py). Each imports nothing of floe's but config.py, data.py and the others here."""
