"""Placeholder: being written (replaced wholesale by the module's author)."""


def _todo(*_args, **_kwargs):
    raise NotImplementedError("ejk_lite.recurrent is being written")


recurrent = reference = _todo
