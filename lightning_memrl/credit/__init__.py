"""Credit assignment and reward shaping from the memory-RL papers, one file per method.

Each method is whichever part its hook needs: a :class:`~lightning_memrl.rewards.RewardFunction`
(scores a trajectory), a :class:`~lightning_memrl.callbacks.MemRLCallback` (reshapes the step's
rewards or advantages), or an :class:`~lightning_memrl.advantages.AdvantageEstimator`. Its docstring
names the paper and states the formula it implements; it is chosen from YAML by ``class_path`` and
logs under ``train/<method>/``.
"""
