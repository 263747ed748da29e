"""The support matrix's tables, one module per engine host: :mod:`~gbmpo.config.hosts.own`,
:mod:`~gbmpo.config.hosts.trl`, :mod:`~gbmpo.config.hosts.verl` (each a dict config key ->
:class:`gbmpo.config.matrix.Support`). They sit in the config layer so that the config checks and
the engines both read them."""
