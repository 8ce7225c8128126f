"""What the model is asked and how it is scored: the `Task` contract, the built-in tasks and JSON-
lines tasks (task.py), rewards (rewards.py), text to token ids and back with chat templates
(textcodec.py), and every call into code floe did not write (usercode.py)."""
