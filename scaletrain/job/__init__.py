"""A run of the whole configuration: the command's model, data, steps, metrics, trackers, fine-tune bases and exports."""
