"""The command line: ``cli.py`` parses every verb's flags and resolves the configuration once;
a verb's own work is the module of its name (train, parity, generate, prepare, run, sweep),
and soak.py is the long-run check of the train path (``python -m scaletrain.commands.soak``)."""
