"""The rank API (:mod:`ringmaster.rank`) inside frameworks that own the training loop: a
Hugging Face ``TrainerCallback`` (:mod:`ringmaster.integrations.hf`), a Lightning
``Callback`` (:mod:`ringmaster.integrations.lightning`) and a helper for an accelerate loop
(:mod:`ringmaster.integrations.accelerate`). Each maps a pause, checkpoint or stop onto the
framework's own switches and saves, and registers the framework's state for the memory
tier. Installed with the extras ``ringmaster[hf]``, ``[lightning]``, ``[accelerate]``."""
