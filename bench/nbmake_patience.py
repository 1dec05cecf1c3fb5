"""pytest plugin for ``gpu_check.py``'s chapter runs: more patience for a notebook kernel to start.

nbclient waits 60 s for a new kernel to answer ``kernel_info``. If it does not (a slow start on a
busy machine, or a kernel that died at start), nbclient cleans up, nbmake reports the exception as
``NBMAKE INTERNAL ERROR`` and, at exit, nbclient's leftover ``atexit`` hook fails with
``assert self.km is not None`` (the symptom seen on the GPU machine). This plugin raises the
start-up timeout to ``EJK_KERNEL_STARTUP_TIMEOUT`` seconds (default 300); ``gpu_check.py`` also
runs each chapter in its own process, keeps the log (the kernel's own stderr included) and retries
once a chapter whose kernel did not start.

    python -m pytest -p nbmake_patience --nbmake book/performance.ipynb   # with bench/ on PYTHONPATH
"""

from __future__ import annotations

import os

from nbclient import client

_original_init = client.NotebookClient.__init__


def _patient_init(self, *args, **kwargs):
    kwargs.setdefault("startup_timeout", int(os.environ.get("EJK_KERNEL_STARTUP_TIMEOUT", "300")))
    _original_init(self, *args, **kwargs)


client.NotebookClient.__init__ = _patient_init
