"""On-policy distillation (``algo.distill``): a frozen teacher checkpoint scores the student's
own sampled tokens, and each response token's advantage gets ``-coef`` times the one-sample
reverse KL estimate ``log pi_student(x_t) - log pi_teacher(x_t)``, added to the estimator's
(task) advantages. ``reverse_kl.py`` holds that arithmetic and its metrics, ``teacher.py`` the
teacher's checks (its directory, model and vocabulary against the student's), its engine's
model config and its memory in ``--estimate``. docs/architecture.md ("On-policy distillation")
says why it is an advantage rather than a loss.
"""
