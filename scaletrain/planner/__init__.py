"""The planner behind ``scaletrain plan``: memory and step time of any layout, predicted.

    inventory.py    the weights each rank holds (the trainer's transforms on a weightless model)
    memory.py       params, grads, optimizer state per rank, ZeRO and offload
    activations.py  saved activations per micro-batch, recompute modes, pipeline schedules
    traffic.py      the step's collectives, byte for byte as the ledger records them
    step_time.py    compute, recomputation, exposed communication, pipeline bubble
    hardware.py     devices and links
    collective_fits.py  collectives measured on one node, an alpha-beta line per operation and group size
    calibrate.py    plan --calibrate: this machine's products, attention, memory and launches measured;
                    calibrate_collectives.py its collectives
    profile.py      the machine profile: its file, where it is found, the device made from it
    machine.py      the machine a run starts on: its profile, else a preset or its measured peak
    predict.py      one layout
    search.py       every layout of a cluster, ranked; report.py prints them
    fit.py          --micro-batch auto: the largest micro-batch that fits this machine
    gate.py         train's and setup()'s check: a run that cannot fit stops before it starts

A model is read through its family's spec alone (models/spec.py): built on
the meta device by ``build``, cut by its tensor and stage plans, sized by its
``ModelShape``; no module here knows a family. docs/planner.md sets the
predictions against measurements.
"""
