"""The training algorithms' steps: SFT (single and multi-turn), one RL step for every
advantage estimator and policy loss, GAE, update-many.
"""
