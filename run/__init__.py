"""A run's housekeeping: its start (start.py: every check before the first byte is written, then
the engine, model and optimizer built), its directory (rundir.py), checkpoints and resume
(checkpoint.py, shardfiles.py), Hugging Face model directories (hfdir.py), the memory plan
(memplan.py) and what it tells a user (planreport.py: its table, and the advice when it does not
fit), the log (runlog.py), --teacher's model (teacher.py), the sampler's evidence checked each step
(evidence.py), and split inference's ranks (remote.py)."""
