"""One watcher per thing the script doctor observes, each a ``Watcher`` (``watchers.base``).  The
``Context`` (``script.context``) builds one of each, in a literal list, and installs them in that order."""
