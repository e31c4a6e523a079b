"""Training with accelerate: the config (:mod:`~rotarium.training.config`), what a run is built from
(:mod:`~rotarium.training.build`), the optimizer and schedule (:mod:`~rotarium.training.optim`), the run folder
(:mod:`~rotarium.training.run_folder`) and its lock (:mod:`~rotarium.training.lock`), what ``--resume`` checks
(:mod:`~rotarium.training.resume`), the loss guard that tells good checkpoints (:mod:`~rotarium.training.guard`),
metrics (:mod:`~rotarium.training.metrics`), the loop (:mod:`~rotarium.training.trainer`) and ``rotarium train``
(:mod:`~rotarium.training.cli`). The data it trains on
is :mod:`rotarium.data`."""
