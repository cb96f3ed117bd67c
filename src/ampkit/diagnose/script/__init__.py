"""The script doctor (``ampkit doctor SCRIPT``): run an unmodified training script under
watchers, apply end-of-run rules, explain exceptions, and replay failing steps op by op."""
