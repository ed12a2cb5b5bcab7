"""Drop-ins for the batch-size finders of the training frameworks: an answer from a simulation of the user's own
model and step, with no out-of-memory trial and no GPU needed to get it.

    lightning.py      BatchSizeEstimator: a Lightning callback where BatchSizeFinder stands
    transformers.py   fit_training_args: TrainingArguments with the batch and accumulation set; PeakMemoryCallback
    accelerate.py     find_executable_batch_size: accelerate's decorator, called once with the estimated batch
    keras.py          estimate_keras: a compiled Keras 3 model's train_step on the torch backend
    fit.py            what they share: the card, batches shaped like the user's, the planner's answer, profiles

Each needs the ``integrations`` extra (``pip install 'batchfit[integrations]'``: lightning, accelerate, keras);
an entry point whose library is missing raises ``MissingExtraError`` naming it. Nothing is imported here.
"""
