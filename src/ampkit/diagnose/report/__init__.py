"""The doctor's output: the terminal listing, the ``ampkit.doctor/1`` JSON file and the HTML page."""
