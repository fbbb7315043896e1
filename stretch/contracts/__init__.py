"""The interfaces where user code and the engine meet: function bases, state descriptors, window
assigners, output tags and connector bases.

They import only ``stretch.common``, so the engine (state, runtime) can depend on them without
depending on the DataStream API that builds jobs. Users import them from their PyFlink homes,
``stretch.datastream.functions``, ``.state``, ``.window``, ``.output_tag`` and ``.connectors``.
"""
