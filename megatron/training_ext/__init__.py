"""This fork's additions to upstream's training entrypoint: flags (``extra_args_provider``) and the
hooks they switch on. Used by ``pretrain_gpt.py``."""
