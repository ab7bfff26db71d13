import sys

from stock_ledger.cli import main

sys.exit(main())
