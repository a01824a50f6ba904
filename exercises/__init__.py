"""The learner's exercises: stubs in ``NN_topic.py``, graded by ``make grade CH=NN``."""
