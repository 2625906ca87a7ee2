"""Where a run's data goes and how people look at it: the logger interface, the run-directory,
W&B and Langfuse loggers, the viewer (`art view`) and plots (`art plot`)."""
