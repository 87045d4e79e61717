"""The snapshot format: one home per convention.

``paths`` (file, directory, arena and job names), ``manifest`` (the typed
manifest schema and its validation), ``commit`` (the COMMIT marker and the
``latest`` pointer), ``codec`` (typed JSON for host state, no pickle).
No I/O policy lives here: ``cudasnap.storage`` reads and writes.
"""
