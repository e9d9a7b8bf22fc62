"""Resource planning (StreamRL's allocator): how many devices should generate and how many train.

``profile.py`` measures or derives what a split's speed depends on (decode cost, training cost,
weight sync, output lengths); ``predict.py`` replays a run of the controller in virtual time on
that profile for one split, mode and staleness bound; ``allocate.py`` tries them all and ranks
them by samples/s or samples per cost unit. ``streamrl plan`` is the command.
"""
