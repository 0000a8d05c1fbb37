"""What the tests share: fixtures, doubles, store openers, sweeps and child-process agents.

Tests import these as ``kit.<module>`` (``pytest`` puts ``tests/`` on the path). The
``*_agent`` modules and ``kit.console_screenshot`` also run as programs, by path; they put
``tests/`` on the path themselves.
"""
