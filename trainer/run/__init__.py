"""Running a job: the SFT -> RL job, resume rules, SIGTERM handling, progress,
the checkpointed parts, the final export, and the --estimate report.
"""
