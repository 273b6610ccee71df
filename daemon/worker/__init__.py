"""One worker: the trainer process tree, its state machine, hang detection and the progress channel."""
