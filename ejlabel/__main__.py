import sys

from ejlabel.cli.main import main

sys.exit(main())
