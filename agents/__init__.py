"""Multi-turn episodes, where an environment or a tool answers between the model's turns: the
environment contract and the built-in ones (envs.py), the episode loop and its token rule
(episodes.py), tool schemas (toolschema.py), call formats (toolcalls.py), running tool calls (toolrun.py),
and the start checks of an episode's parts (envcheck.py)."""
