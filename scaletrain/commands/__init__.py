"""The command line: ``cli.py`` builds the parser from the verbs and runs the one asked for; each
verb is the module of its name (train.py holds train and finetune), which adds its flags, resolves
the configuration once and does the work. soak.py is the long-run check of the train path
(``python -m scaletrain.commands.soak``)."""
