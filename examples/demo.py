"""keyop-messenger demo: two instances federating over mutual TLS on localhost.

The demo lives in the package (keyop_messenger/demo.py) so that an installed
wheel runs it as ``keyop-messenger demo``; this script runs the same code.
"""

from keyop_messenger.demo import main

if __name__ == "__main__":
    main()
