"""rotarium's own word list for the RULER tasks (:mod:`rotarium.evaluation.ruler`), the fallback where the
``wonderwords`` package (RULER's lists, and the default) is not installed: needle keys are adjective-noun pairs, as
RULER draws them, and common-words extraction draws from both lists.

Kept in the source, not read from a corpus or a package, so that ``--ruler-words rotarium`` gives the same samples
on every machine whatever is installed.
"""
from __future__ import annotations

_ADJECTIVES = """
able absent active actual afraid agile alert alive amber ample ancient angry annual anxious aqueous arctic ardent
autumn awake aware azure basic bitter blank bleak blind blond bold bored bossy brave brief bright brisk broad broken
bronze brown bumpy busy calm candid careful casual cheap cheerful chief chilly civic clean clear clever close cloudy
clumsy coarse cold common cosmic costly crazy creamy crisp crooked cruel curious curly cute damp daring dark dear
decent deep dense direct dirty distant dizzy dreary dry dual dull dusty eager early earnest eastern easy elastic
elder elegant empty endless equal exact exotic faint fair false famous fancy fast fatal feeble fierce final fine
firm flat fluffy fond formal fragile frank free fresh friendly frosty frozen funny fuzzy gentle giant gifted gloomy
glossy golden graceful grand grassy grateful great greedy green grey grim gritty hairy handy happy hardy harsh hasty
healthy heavy hidden hollow honest hopeful huge humble hungry icy idle immense inner ivory jolly juicy keen kind
large late lavish lazy lean light little lively lonely long loose loud lovely loyal lucky lunar magic major mellow
merry mighty mild minor misty modern modest moist muddy narrow nasty native neat nervous new nimble noble noisy
normal odd oily old olive open orange ornate pale patient peaceful plain pleasant plump polite poor pretty prime
proud purple quick quiet rapid rare raw ready real regal rich rigid ripe robust rosy rough round royal rude rural
rusty sacred safe salty sandy scarlet secret serene sharp shiny short shy silent silky silver simple sincere sleepy
slim slow small smart smooth snowy soft solar solid sour spare spicy splendid stable steady steep sticky stiff
stormy strange strict strong subtle sudden sunny super sweet swift tall tame tender thick thin thirsty tidy tiny
tired tough tropical true twin ugly unique upper urban usual vacant vague valid vast velvet violet vital vivid
warm wary weary wet white whole wide wild windy wise witty wooden woolen young zealous
"""

_NOUNS = """
acorn actor airport album anchor angle ankle apple apron arch arena army arrow artist atlas attic autumn avenue
badge bakery ball balloon bamboo banana band banner barn barrel basket beach beacon beard bell belt bench berry
bicycle bird biscuit blanket blossom boat bonnet book boot bottle boulder bowl box bracelet branch bread brick bridge
broom bubble bucket buffalo bugle bundle butter button cabin cable cactus cake camel camera canal candle canoe canyon
captain car carpet carrot castle cat cave cellar chair chalk channel cherry chest chimney circle city cliff clock
cloud clover coast coat coconut coffee coin comet compass cookie copper coral corner cottage cotton county court
cradle crane crater crayon creek cricket crown crystal cup curtain cushion daisy dancer desert desk diamond dinner
doctor dolphin door dragon drawer dream drum eagle earth easel elbow elephant engine envelope falcon farm feather
fence ferry festival field finger fire flag flame flower flute forest fork fountain fox frog garden garlic gate
giraffe glacier glass glove goat gold grape guitar hammer harbor harp hat hawk helmet hill hive honey horizon horse
hotel house island ivy jacket jaguar jar jelly jewel journal jungle kettle key kitchen kite knee ladder lagoon lake
lamp lantern lemon letter library lily lion lizard lobster locket magnet mango map marble market meadow melon mirror
monkey moon mountain mouse museum needle nest noodle notebook novel oak ocean office olive onion orchard orchid otter
owl oyster paddle palace panda paper parade parrot peach pearl pebble pencil pepper piano pickle pigeon pillow pine
planet plate plum pocket pond poppy potato puddle pumpkin puppet quilt rabbit radio rain raven ribbon river road
robin rocket roof rope rose ruby saddle sail salad salmon sand scarf school shadow shell ship shoe shovel silk sky
sled snail snow socket sofa spider spoon spring squirrel stable star station statue stone stove stream street sugar
summer sun swan sword table tailor teapot temple tent thimble thunder tiger timber toast tomato tower town tractor
train treasure tree trumpet tulip tunnel turtle umbrella valley vase velvet village violin volcano wagon wall walnut
wand water whale wheat wheel whistle willow window winter wolf wool yacht yard zebra
"""

ADJECTIVES = tuple(_ADJECTIVES.split())
NOUNS = tuple(_NOUNS.split())
