"""The services the script watchers share, below the watchers: a watcher imports services, never
another watcher.  The ``RunState`` (``script.state``) holds one of each, as a named field."""
