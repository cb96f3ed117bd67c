"""One watcher per thing the script doctor observes: autocast, optimizers and schedulers,
backward, GradScaler, the user's models, and checkpoints (torch.save/torch.load)."""
