"""`dflash-train recipe`: from a target to a served drafter in one command (docs/recipe.md).

memory.py says what fits on the card and plan.py sizes the run to the machine (pure numbers; step_time.py
and regen_time.py scale the measured SmolLM2 times to another target); oom.py turns an out-of-memory error
into the setting to lower; inputs.py reads the target's shape and the data's size; records.py keeps each
stage's record (the sha256 of its inputs); stages.py builds each stage's child command; run.py runs them in order, skipping, resuming or redoing; report.py writes
RUN/report.json, RUN/report.png and RUN/REPORT.md; progress.py shows the stages and the ETA.
"""
