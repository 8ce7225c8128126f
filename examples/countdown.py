"""The environment docs/agents.md shows: guess a sum's answer, told "higher" or "lower" after each
miss; the reward falls with the tries. Rows: examples/sums.jsonl (its `answer` column).

    python train.py --task jsonl:examples/sums.jsonl --env examples/countdown.py:Countdown --model checkpoints/arith-tiny \\
        --steps 20 --lr 2e-4 --max-new-tokens 4 --eval-prompts 128      # the README's run
"""


class Countdown:                                  # python train.py --env my_env.py:Countdown ...
    def reset(self, row, seed):                   # row: the jsonl row's columns, `prompt` included
        self.target, self.tries, self.won = int(row["answer"]), 0, False
        return None                               # None: the row's own prompt (or return one)
    def step(self, text, ids):                    # the model's turn: its text and its sampled ids
        self.tries += 1
        self.won = text.strip() == str(self.target)
        hint = "higher" if text.strip().isdigit() and int(text) < self.target else "lower"
        return ([] if self.won else [{"role": "user", "content": hint}]), self.won
    def reward(self):                             # once the episode ended
        return float(self.won) / max(self.tries, 1)  # a first turn cut by --max-new-tokens never reached step
