"""Reward functions for examples/sums.jsonl, in the shape floe (and TRL) call them with.

Each gets the batch's `prompts` and `completions` (text, cut at the stop token) and every other
column of the file as a keyword argument, one value per completion; it returns one float per
completion (None skips a sample).

    python train.py --task jsonl:examples/sums.jsonl --model checkpoints/arith-tiny \
        --reward examples/rewards.py:close --reward examples/rewards.py:just_a_number --reward-weights 0.8 0.2
"""

import re


def close(prompts, completions, answer, **kwargs):
    """1 for the right number, halving with each unit it is off by (partial credit: a dense signal)."""
    out = []
    for text, want in zip(completions, answer):
        found = re.findall(r"-?\d+", text)
        out.append(0.0 if not found else 0.5 ** min(abs(int(found[-1]) - int(want)), 60))
    return out


def just_a_number(prompts, completions, **kwargs):
    """1 when the completion is a number and nothing else: the format the task asks for."""
    return [float(re.fullmatch(r"-?\d+", text.strip()) is not None) for text in completions]
