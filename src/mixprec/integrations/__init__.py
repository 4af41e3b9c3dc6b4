"""Framework callbacks over :func:`mixprec.watch`; each module imports its framework, this package imports none.

* :mod:`mixprec.integrations.transformers` -- ``MixprecCallback``, a Hugging Face ``TrainerCallback``;
* :mod:`mixprec.integrations.lightning` -- ``MixprecCallback``, a Lightning ``Callback``.

Both take ``mixprec.watch``'s keyword arguments (``out=``, ``every=``, ``on_fault=``, ...), find the model,
the optimizer and the loss scaler through the framework's own state, and never patch the framework.
"""
