"""Self-checks for the exercises: ``minirt.checks.check_<thing>(...)``.

Each checker prints one success line or raises ``AssertionError`` saying which
input was tried, what was expected and what came back. One module per chapter.
"""

from ._common import passed  # noqa: F401
from .ch00 import *  # noqa: F401,F403
from .ch01 import *  # noqa: F401,F403
from .ch02 import *  # noqa: F401,F403
from .ch03 import *  # noqa: F401,F403
from .ch04 import *  # noqa: F401,F403
from .ch05 import *  # noqa: F401,F403
from .ch06 import *  # noqa: F401,F403
from .ch06a import *  # noqa: F401,F403
from .ch07 import *  # noqa: F401,F403
from .ch08 import *  # noqa: F401,F403
from .ch09 import *  # noqa: F401,F403
from .ch09b import *  # noqa: F401,F403
from .ch09c import *  # noqa: F401,F403
from .ch10 import *  # noqa: F401,F403
from .ch11 import *  # noqa: F401,F403
from .ch12 import *  # noqa: F401,F403
from .ch13 import *  # noqa: F401,F403
